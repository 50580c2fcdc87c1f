"""Engram table tiers, one file each: device (in the model's state), host RAM, disk files, sharded over ranks."""
