"""Build-time import check of the cluster image: every piece imports and the versions match pyproject."""

import importlib

PINS = {"sglang": "0.5.10", "megatron.core": "0.19.2"}

for mod in ("torch", "transformers", "sglang", "megatron.core", "transformer_engine", "hydra", "mrl",
            "mrl.megatron.model", "mrl.models"):
    m = importlib.import_module(mod)
    print(f"{mod:22s} {getattr(m, '__version__', '')}")
for mod, want in PINS.items():
    got = importlib.import_module(mod).__version__
    assert got == want, f"{mod} {got} != pinned {want}"
from mrl._compat.te import HAVE_TE  # noqa: E402

assert HAVE_TE, "transformer_engine does not import in the image"
print("image ok")
