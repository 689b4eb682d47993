"""Images in prompts (vision-language models).

A prompt holds one placeholder per image; the model's processor (`processing`) expands each
to the image's token count and describes every image as a `MultiModalFeature`: where its
placeholder tokens lie and its processed pixels. The scheduler runs an image's encoder when a
step first reaches its span, under an encoder cache budget (`encoder_cache`); the runner keeps
the encoder's rows by the image's hash and writes them over the placeholders' token
embeddings (`runner`). A model that takes images implements the hooks of
`model.SupportsMultiModal`.
"""

from pagedserve.multimodal.inputs import MultiModalFeature, MultiModalPrompt, PlaceholderRange

__all__ = ["MultiModalFeature", "MultiModalPrompt", "PlaceholderRange"]
