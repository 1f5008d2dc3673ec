"""Embeddings: the engine as a pooling model (vLLM's `--runner pooling`).

A pooling engine runs each prompt through the decoder once and hands back one vector per prompt
instead of generated tokens: the final norm's output at the prompt's last token (LAST, what
decoder embedding models such as Qwen3-Embedding and e5-mistral are trained for), the mean over the
prompt (MEAN) or its first token (CLS), optionally L2-normalized and cut to a Matryoshka prefix.

- config.py: which runner a model gets, and its pooler settings (sentence-transformers files,
  `--pooler-config`);
- params.py: a request's pooling parameters (`dimensions`, `normalize`);
- pooler.py: the vectors out of a step's hidden states, and the requests they finish.
"""
