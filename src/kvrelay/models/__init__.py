"""Models bundled with kvrelay."""

from pathlib import Path

# stories260K: a real 260K-parameter Llama trained on TinyStories (MIT, see its README).
BUNDLED_MODEL = Path(__file__).parent / "stories260K"
