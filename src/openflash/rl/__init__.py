"""Reinforcement learning with verifiable rewards (`openflash rl`): GRPO on a LoRA adapter, the engine sampling the
rollouts. tasks.py reads the prompts, rollout.py samples groups with the engine, rewards.py (and sandbox.py for unit
tests) scores them, grpo.py holds the objective's math, trainer.py runs the steps and the run folder."""
