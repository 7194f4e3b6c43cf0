"""Serve (or run once) a TensorRT-LLM speculative-decoding pair with SharpDraft's query scale on the drafter.

NOT EXECUTED: written without a GPU and without TensorRT-LLM (it cannot be installed on the machine this was
written on). The patch it installs (plugins/trtllm_patch.py) is tested only on stand-ins of TensorRT-LLM's classes.

    python examples/trtllm/serve_with_query_scale.py --family dflash --model /models/Qwen3-8B \
        --config examples/trtllm/dflash.yaml [--ref-keys 2048] [--route multiply] [--port 8000]
    python examples/trtllm/serve_with_query_scale.py --family pard --model ... --config examples/trtllm/pard.yaml \
        --prompt "Summarise ..."        # one LLM-API generation instead of serving, then prints the hook counters

The patch must live in the process that builds the drafter, so this script sets TLLM_WORKER_USE_SINGLE_PROCESS=1
(single-GPU, executor in this process) before TensorRT-LLM is imported. Multi-GPU worker processes are not covered.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from plugins.rule import QueryScaleProfile  # noqa: E402
from plugins.trtllm_patch import FAMILIES, ROUTES, install_query_scale, stats  # noqa: E402

SPEC_CONFIG_CLASSES = {"DFlash": "DFlashDecodingConfig", "PARD": "PARDDecodingConfig", "Eagle3": "Eagle3DecodingConfig"}


def _require_trtllm():
    try:
        import tensorrt_llm  # noqa: F401  (import check only)
    except ImportError as e:
        sys.exit(f"TensorRT-LLM is not importable ({e}). Run this on a CUDA machine with `pip install tensorrt-llm` "
                 f"(PyTorch backend, main 2026-09 or the matching release).")


def _serve(model: str, config: str, host: str, port: int) -> None:
    import click
    from tensorrt_llm.commands.serve import main as serve_main

    args = [model, "--config", config, "--host", host, "--port", str(port)]
    if isinstance(serve_main, click.Group):  # `trtllm-serve serve <model>` on trees where serve is a group
        args = ["serve", *args]
    serve_main(args=args, standalone_mode=True)


def _generate_once(model: str, config: str, prompt: str) -> None:
    import yaml
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.llmapi import llm_args

    options = yaml.safe_load(Path(config).read_text())
    spec = dict(options.pop("speculative_config"))
    spec_cls = getattr(llm_args, SPEC_CONFIG_CLASSES[spec.pop("decoding_type")])
    with LLM(model=model, speculative_config=spec_cls(**spec), **options) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=128, temperature=0.0))
        print(out[0].outputs[0].text)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", required=True, choices=FAMILIES)
    p.add_argument("--model", required=True, help="target model (HF folder or id)")
    p.add_argument("--config", required=True, help="trtllm-serve YAML with a speculative_config block")
    p.add_argument("--ref-keys", type=int, default=None, help="override the family's ref_keys")
    p.add_argument("--route", choices=ROUTES, default="multiply")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prompt", default=None, help="run one LLM-API generation instead of serving")
    a = p.parse_args(argv)

    os.environ.setdefault("TLLM_WORKER_USE_SINGLE_PROCESS", "1")
    _require_trtllm()
    report = install_query_scale({a.family: QueryScaleProfile.for_family(a.family, ref_keys=a.ref_keys)},
                                 route=a.route)
    print(f"SharpDraft query scale installed on TensorRT-LLM {report.version}: {report.routes} via {report.hooks}")
    if a.prompt is not None:
        _generate_once(a.model, a.config, a.prompt)
        print("hook counters:", stats())  # q_scaled / logn_applied must be > 0, else the drafter never hit the hook
    else:
        _serve(a.model, a.config, a.host, a.port)


if __name__ == "__main__":
    main()
