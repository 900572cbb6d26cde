"""convolab: a measured ladder of convolution kernels, running LeNet-5 on Fashion-MNIST."""

__version__ = "0.1.0"
