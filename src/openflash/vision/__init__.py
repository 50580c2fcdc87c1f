"""Images in: preprocessing (pixels to ViT patches and the token grid) and prompt assembly (image spans in the
token sequence, the rows a step hands the model). The ViT and aligner themselves are in model/vision.py."""
