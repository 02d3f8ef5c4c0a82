"""Wire format: tensor codec and generated gRPC code."""
