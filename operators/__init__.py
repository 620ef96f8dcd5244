"""LLM operators built on pipeline."""
