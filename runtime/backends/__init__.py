"""The model backends the loop (runtime/engine.py) drives: each runs a target and a drafter graph of an engines/
folder and hands the loop logits, tapped features and draft tokens as numpy arrays.

- :mod:`runtime.backends.protocols`: ``TargetBackend`` / ``DrafterBackend``, what the loop needs of a backend.
- :mod:`runtime.backends.ort`: ONNX Runtime graphs (the default; int4 / int8 / fp32 exports), one drafter class
  per family (``ORT_DRAFTERS``).
- :mod:`runtime.backends.pytorch`: PyTorch modules rebuilt from the folder's checkpoints (fp32 DFlash folders;
  the fused query-scaled attention op on CUDA).

Nothing here is imported by this file: a torch-free process imports the ONNX Runtime backend alone.
"""
