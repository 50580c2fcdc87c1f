"""Tools around the model: planning (plan, placement_plan), the parity check against the official goldens, random-weights
checkpoints (synth) and the demo (the README's main job)."""
