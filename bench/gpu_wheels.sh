#!/bin/bash
# The wheels a GPU session needs that its machine lacks, into .whl/ (git-ignored; bench/gpu_session.sh installs them
# at its start, and the device tool carries them: run(..., carry=[".whl"])). Run here, where PyPI is reachable:
#   bash bench/gpu_wheels.sh
# The machine has Python 3.12, torch 2.11, transformers 5.17, accelerate 1.15, huggingface_hub 1.33, pyarrow, pandas,
# httpx, xxhash, fsspec, psutil, jinja2; it lacks (pins checked against those):
#   trl 1.16.0          TRL's DPOTrainer, step 4 (it needs transformers>=4.56.2, accelerate>=1.10.1, datasets>=4.7.0)
#   datasets 4.8.5      trl imports it (needs pyarrow>=21, huggingface-hub<2.0, dill<0.4.2, multiprocess<0.70.20)
#   dill 0.4.1, multiprocess 0.70.19 (py312)   datasets' two requirements the machine does not have
#   torchao 0.18.0      QLoRA's NF4, step 6 (its C++ ops load with torch>=2.11: NF4 itself is Python)
set -e
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d .whl trl==1.16.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 torchao==0.18.0
ls -l .whl
echo "total: $(du -cb .whl/*.whl | tail -1 | cut -f1) bytes in $(ls .whl | wc -l) wheels" \
  "(the device tool carries 64 MiB with the working tree)"
