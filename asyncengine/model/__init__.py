"""Model loading and asyncengine's paged attention plugged into transformers."""
