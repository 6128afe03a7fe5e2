"""Checkpoints of FSDP2 models with exact per-parameter dtypes, on ``torch.distributed.checkpoint``.

One module per job:

- ``state``: :func:`model_state_dict` / :func:`load_model_state_dict`, in-memory state dicts
  ("full": consolidated CPU tensors on rank 0; "sharded": DTensors on every rank), validated
  before anything is loaded.
- ``atomic``: the on-disk protocol that makes a save atomic (a sibling temporary directory, a
  completion marker written last, two renames) and recovers what an interrupted save left.
- ``metadata``: the checkpoint's JSON marker and DCP's tensor metadata
  (:func:`read_checkpoint_metadata`).
- ``save_load``: :func:`save_checkpoint` / :func:`load_checkpoint`, model (+ optimizer)
  checkpoints in DCP format, loadable at another world size or mesh.
- ``export``: :func:`export_safetensors`, ``model.safetensors`` (+ ``config.json``) for Hugging
  Face ``from_pretrained``.
- ``collective``: what every rank must agree on (rank 0's value, the first rank's error).

Every tensor keeps its own dtype: a unit that stores some parameters in fp32 and others in bf16
saves and loads each in its own dtype. Every error is a :class:`CheckpointError` naming the path
and the fix. Public through :mod:`fsdp_precision.checkpoint`; see ``docs/checkpoints.md``.
"""
