"""The quality gate: WikiText-2 and its tokenizer, NIAH prompts, perplexity and the eligibility
rule."""
