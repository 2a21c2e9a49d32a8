"""gRPC server reflection under both names clients ask for: grpc.reflection.v1 (newer grpcurl
releases ask for it first) and grpc.reflection.v1alpha (older tools).

grpcio-reflection implements only v1alpha. The v1 proto is the same protocol under a new package
(the same messages, field for field), so one servicer answers both: v1alpha as the library
registers it, v1 through a generic handler that reads and writes the wire-identical messages, and
v1's file descriptor (v1alpha's, renamed) is added to the pool so that v1 can describe itself.
"""
from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_PACKAGE = "grpc.reflection.v1"
V1 = f"{V1_PACKAGE}.ServerReflection"


def enable_reflection(server: grpc.aio.Server, service_names: tuple[str, ...]) -> None:
    """Serve reflection of `service_names` (and of both reflection services) on `server`."""
    _add_v1_descriptor()
    servicer = reflection.aio.ReflectionServicer((*service_names, V1, V1ALPHA))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)}),))


def _add_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(V1)
        return  # added already (another server in this process)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old = f".{proto.package}."
    proto.name, proto.package = "grpc/reflection/v1/reflection.proto", V1_PACKAGE
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(old, f".{V1_PACKAGE}.")
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(old, f".{V1_PACKAGE}.")
        method.output_type = method.output_type.replace(old, f".{V1_PACKAGE}.")
    pool.Add(proto)
