"""Generated protobuf/gRPC code for the kvrelay.v1 wire contract (protos/kvrelay/v1/*.proto)."""
