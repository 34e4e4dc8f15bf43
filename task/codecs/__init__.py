"""Codecs of high-dimensional PATE: the registry of kinds and shared helpers (:mod:`task.codecs.core`), the contract
of a kind's fitter (:mod:`task.codecs.contract`: ``Compressor``, ``PublicFit``, ``make_compressor``) and one module
per kind (pca, ae, anchored, identity) holding both sides of it -- the hospitals' encoder, verify and sensitivity, the
server's fitter and decoder, the defaults it reads from the preset's ``Codec`` group -- each registering its
``CodecKind`` on import. ``from task import codecs`` gives all of them; new code should reach a kind's own functions
and classes through its module."""

from task.codecs.core import *  # noqa: F401,F403 - the package's public interface
from task.codecs.core import (ROW_TOLERANCE, CodecKind, CodecPolicy, CodecRefused, CodecState, codec_kind,  # noqa: F401
                             codec_kinds, codec_sensitivity, encode, fallback_encoding, kind_of, make_encoder,
                             register_codec, unregister_codec, verify_codec)
from task.codecs.contract import Compressor, PublicFit, answering_teachers, make_compressor  # noqa: F401
from task.codecs.ae import (AutoencoderCompressor, AutoencoderNet, AutoencoderSettings, arrays_to_module,  # noqa: F401
                           autoencoder_from_state, encoder_arrays, module_to_arrays)
from task.codecs.anchored import (ANCHOR_KEY, ANCHORED_DECODERS, BINS_KEY, T1GD_CHANNEL,  # noqa: F401
                                 AnchoredResidualCompressor, anchor_regions, anchored_decode, anchored_encode,
                                 anchored_latent_dim, anchored_shells, binned_regions, intensity_bin_map,
                                 shipped_bins, shrink_latents, with_anchor)
from task.codecs.pca import ORTHONORMAL_TOLERANCE, PCACompressor, choose_components  # noqa: F401
from task.codecs.identity import IdentityCompressor  # noqa: F401 - also registers the identity kind
