"""The engine side of the hand-off: inference engines hold and compute what training kept.

One module per job:

- ``kept``: what an engine must hold, from the one description the library writes (an export's
  record, a weight stream's metadata);
- ``readback``: reading back what an engine holds (or computes, where a kernel hides a weight)
  and naming what it rounded;
- ``transfer``: weights to an engine in another process: the metadata, then the tensors in their
  own dtypes, over ``torch.distributed``;
- ``vllm``: vLLM's extension points (its general plugin, its pluggable layers, its model
  registry), its in-place updates and the builds' repairs. vLLM is imported only there, and only
  inside vLLM's own processes or when a user hands it an engine.
"""
