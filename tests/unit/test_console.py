"""Library log output goes to the rank's log file, mrl's own warnings to the console."""

import subprocess
import sys

_PROBE = """
import logging, sys, warnings
import torch, torch._dynamo  # torch gives its logger and many children console handlers on import
from mrl.console import route_library_output
path = route_library_output(sys.argv[1], 0)
logging.getLogger("torch._dynamo.convert_frame").warning("LIB-DYNAMO")
logging.getLogger("torch.utils.cpp_extension").warning("LIB-TORCH")
logging.getLogger("transformers.modeling_utils").warning("LIB-HF")
warnings.warn("LIB-PYWARN", DeprecationWarning)
print(path)
"""


def test_library_logs_go_to_the_rank_log_not_the_console(tmp_path):
    out = subprocess.run([sys.executable, "-W", "always", "-c", _PROBE, str(tmp_path)], capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    for marker in ("LIB-DYNAMO", "LIB-TORCH", "LIB-HF", "LIB-PYWARN"):
        assert marker not in out.stderr and marker not in out.stdout
    log = open(out.stdout.strip().splitlines()[-1]).read()
    for marker in ("LIB-DYNAMO", "LIB-TORCH", "LIB-HF", "LIB-PYWARN"):
        assert marker in log
