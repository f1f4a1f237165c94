"""DeepSpeed as the training engine: one trained rank (``rank.TrainRank``), its config and
schedule (``strategy``), checkpoints and the Hugging Face export (``checkpoint``)."""
