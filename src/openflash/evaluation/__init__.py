"""Scoring models: lm-evaluation-harness over the engine, held-out perplexity (`openflash eval`)."""
