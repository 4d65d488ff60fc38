"""batchrl: offline, batch-mode RL post-training of LLMs (GRPO/PPO family) as a job over Parquet."""

__version__ = "0.1.0"
