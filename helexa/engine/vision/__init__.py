"""Images in: what a vision-language checkpoint needs beside its decoder.

- `inputs`: the image profile a checkpoint's configs give (patch, merge, normalisation,
  pixel bounds, special tokens) and `ImageInput`, a decoded and resized image as the node
  hands it to the engine.
- `preprocess`: a PIL image resized as the reference does it, and an `ImageInput` cut into
  the tower's flattened patches.
- `tower`: the Qwen3.5 / Qwen3.6 vision encoder (patch embedding, interpolated learned
  positions, 2-D rotary, blocks, the spatial merger into the decoder's width).
- `mrope`: M-RoPE positions of a prompt with image runs, and the decode offset after them.
"""
