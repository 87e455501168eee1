# A real train_sft.py run (argv as the script takes it) at the preset's own vocabulary, as plan.py plans it (the byte
# tokenizer's ids fit in it); prints CUDA's peak allocated and reserved memory at exit.
import atexit, os, runpy, sys, torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanopack import startup
preset_config = startup.config_from_preset
startup.config_from_preset = lambda name, vocab_size=None, **kw: preset_config(name, **kw)
atexit.register(lambda: print(f"REAL PEAK allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
                              f"reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB" if torch.cuda.is_available()
                              else "REAL PEAK: no CUDA", flush=True))
sys.argv = ["train_sft.py"] + sys.argv[1:]
runpy.run_path(os.path.join(sys.path[0], "train_sft.py"), run_name="__main__")
