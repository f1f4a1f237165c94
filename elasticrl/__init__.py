"""elasticrl: RL alignment of language models, one spec from a workstation to a cluster."""
__version__ = "0.1.0"
