"""The ahead-of-time kernel build: NVRTC compiles kernels/ to cubin and PTX for a profile's arch, with no GPU (docs/build.md)."""
