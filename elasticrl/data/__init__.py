"""Datasets: JSON-lines records, chat formatting, tokenised batches, deterministic order."""
