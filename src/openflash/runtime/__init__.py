"""What runs a built model: the mathematics is model/'s, the execution is here.

    runtime.py       Runtime: the model with its tokenizer, Engram memory, experts and decode graph; what callers step
    open.py          open_model: a preset, checkpoint or run folder opened and placed as a Runtime
    adapters.py      LoRA adapters served beside the base model, checked whole before any is attached
    engram_tiers.py  the Engram tables moved to the host or disk tier (exported where no table files exist)
    placement.py     Placement: where each part goes (device, weights, experts' and Engram tables' tiers, compile)
    decode_graph.py  a decode step as one compiled graph at fixed shapes
    cuda_graph.py    recording that graph as a CUDA graph (Recorder)

Kept import-light: the command line reads placement.py's choices without importing torch.
"""
