"""Images (and later video) in prompts.

- `media`: fetching and decoding `image_url` parts (data URLs, file URLs
  under allowed directories, http(s) with size, time and address limits).
- `hashing`: content identity, a sha256 over decoded pixels.
- `prompt`: chat messages with images to prompt tokens plus `PromptImage`s.
- `vision_cache`: projected image embeddings by content, under a byte budget.
"""
