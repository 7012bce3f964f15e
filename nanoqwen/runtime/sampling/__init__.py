"""Token selection: the device-resident Sampler, its per-slot state, and the reference
implementation it is tested against."""
