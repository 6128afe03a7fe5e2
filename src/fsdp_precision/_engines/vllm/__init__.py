"""vLLM: kept tensors held and computed as training did, on the first load and every update.

- ``plugin``: the ``vllm.general_plugins`` entry point;
- ``archs``: what the integration knows, as data;
- ``hold``: one model's kept tensors (built, converted or refused; read back after each load);
- ``layers``, ``models``: the layer and model classes vLLM builds (they import vLLM);
- ``experts``: the expert layers' post-load processing vLLM's update path skips;
- ``update``: in-process updates and the receiving side of a remote trainer.
"""
