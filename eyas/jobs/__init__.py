"""Jobs built on ``LLM``: ``eyas extract`` (hidden-state datasets) and ``eyas regenerate`` (the target's own
replies). They sit above the engine; the writers the engine itself uses live in ``eyas.data``."""
