"""File helpers: the shard index and positioned reads (shards), checksums (manifest), atomic writes (atomic) and the
layout of a training run folder (run_dir)."""
