"""Codecs of high-dimensional PATE: the registry and shared helpers (:mod:`task.codecs.core`) and one module per
kind (pca, ae, anchored, identity), each registering itself on import. ``from task import codecs`` gives all of
them, as one module did before the kinds were split; new code should reach a kind's own functions through its module."""

from task.codecs.core import *  # noqa: F401,F403 - the package's public interface
from task.codecs.core import (CodecKind, CodecPolicy, CodecRefused, CodecState, codec_kinds, codec_sensitivity,  # noqa: F401
                             encode, fallback_encoding, kind_of, make_encoder, register_codec, unregister_codec,
                             verify_codec)
from task.codecs.ae import (AutoencoderNet, arrays_to_module, autoencoder_from_state, encoder_arrays,  # noqa: F401
                           module_to_arrays)
from task.codecs.anchored import (ANCHOR_KEY, BINS_KEY, T1GD_CHANNEL, anchor_regions, anchored_decode,  # noqa: F401
                                 anchored_encode, anchored_latent_dim, anchored_shells, binned_regions,
                                 intensity_bin_map,
                                 shipped_bins, shrink_latents, with_anchor)
from task.codecs.pca import ORTHONORMAL_TOLERANCE  # noqa: F401
from task.codecs import identity as _identity  # noqa: F401 - registers the identity kind
