"""Multi-turn rollouts with tools (generate.tools): the tools and their schemas (`tools`), the Hermes call format and
the tool turn (`calls`), the agent loop that batches a shard's conversations per turn on an engine (`loop`), and the
rollout columns and counts it produces (`columns`). A components-layer package beside batchrl.engines: it drives an
engine it is given and knows no stage."""
