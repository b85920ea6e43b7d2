"""Omni models (audio and image towers) served with images through the generic adapter
(models/vlm_generic.py): what their mlx-vlm processors need to run on images alone. Audio is
not served: a request's parts are text and images (and video where the family takes it)."""

from __future__ import annotations

from mlx_vlm.models.minicpmo.processing_minicpmo import MiniCPMOProcessor


class MiniCPMOImages(MiniCPMOProcessor):
    """mlx-vlm's MiniCPM-o processor over images. It takes no audio feature extractor when
    given no audio, but transformers' ProcessorMixin refuses it one that is None (a type
    check of each attribute); a default Whisper extractor stands in, and no audio reaches it."""

    # (transformers reads the processor's parts off this signature: it is mlx-vlm's.)
    def __init__(self, image_processor=None, audio_processor=None, tokenizer=None, **kwargs):
        from transformers import WhisperFeatureExtractor

        super().__init__(image_processor=image_processor, audio_processor=audio_processor or WhisperFeatureExtractor(),
                         tokenizer=tokenizer, **kwargs)
