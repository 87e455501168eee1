import random

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def seed_everything():
    # every test starts from the same RNG state, whatever ran before it
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
