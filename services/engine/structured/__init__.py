"""Structured output: grammars (llguidance) compiled per request spec and applied as token bitmasks."""
