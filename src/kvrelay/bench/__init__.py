"""`kvrelay bench`: load any OpenAI-compatible server and measure it from the client side."""
