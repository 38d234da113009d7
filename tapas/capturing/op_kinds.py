"""The TensorFlow op types capture knows, by what grouping does with them.

In:  nothing (tables).
Out: frozensets of op type names: heavy ops (matmuls, convolutions) that seed GraphNodes,
     light ops (elementwise, reshapes, softmax) that join them, reductions, gathers, batch
     norms, shape queries, sources, side effects, scatters and variable reads;
     ``KNOWN_OPS`` is their union (anything else becomes an ``opaque`` GraphNode).

This module imports no TensorFlow.
"""


MATMUL_OPS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})
CONV_OPS = frozenset({"Conv1D", "Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput",
                      "Conv3DBackpropInputV2", "Conv"})
HEAVY_OPS = MATMUL_OPS | CONV_OPS
GATHER_OPS = frozenset({"GatherV2", "Gather", "ResourceGather", "GatherNd", "ResourceGatherNd"})
BATCHNORM_OPS = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"})
SOFTMAX_OPS = frozenset({"Softmax", "LogSoftmax"})
UNARY_OPS = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Sigmoid", "Tanh", "Softplus", "Softsign",
    "Gelu", "Erf", "Erfc", "Exp", "Expm1", "Log", "Log1p", "Sqrt", "Rsqrt", "Square", "Neg",
    "Abs", "Sign", "Reciprocal", "Inv", "Floor", "Ceil", "Round", "Rint", "Cast", "Identity",
    "StopGradient", "PreventGradient", "Snapshot", "Sin", "Cos", "IsNan", "IsInf", "IsFinite",
    "LogicalNot", "ZerosLike", "OnesLike", "CheckNumerics", "EnsureShape", "Swish",
    "ClipByValue"})
BINARY_OPS = frozenset({
    "Add", "AddV2", "AddN", "Sub", "Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan", "FloorDiv",
    "FloorMod", "TruncateDiv", "Maximum", "Minimum", "Pow", "SquaredDifference", "BiasAdd",
    "Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual", "LogicalAnd",
    "LogicalOr", "SelectV2", "Select", "Xdivy", "Xlogy"})
RESHAPE_OPS = frozenset({
    "Reshape", "Transpose", "ConjugateTranspose", "ExpandDims", "Squeeze", "StridedSlice",
    "Slice", "ConcatV2", "Concat", "Pack", "Unpack", "Split", "SplitV", "Tile", "Pad", "PadV2",
    "MirrorPad", "BroadcastTo", "ReverseV2", "Roll", "OneHot", "MatrixBandPart",
    "DepthToSpace", "SpaceToDepth", "ResizeBilinear", "ResizeNearestNeighbor"})
REDUCE_OPS = frozenset({
    "Mean", "Sum", "Max", "Min", "Prod", "All", "Any", "ArgMax", "ArgMin", "MaxPool",
    "MaxPoolV2", "AvgPool", "MaxPool3D", "AvgPool3D", "TopKV2", "Cumsum", "Cumprod",
    "EuclideanNorm", "L2Loss", "SparseSoftmaxCrossEntropyWithLogits",
    "SoftmaxCrossEntropyWithLogits"})
META_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank", "BroadcastArgs",
                      "BroadcastGradientArgs"})
SOURCE_OPS = frozenset({"Const", "Range", "Fill", "LinSpace", "Placeholder",
                        "PlaceholderWithDefault"})
SIDE_EFFECT_OPS = frozenset({"NoOp", "Assert", "AssignVariableOp", "AssignAddVariableOp",
                             "AssignSubVariableOp", "PrintV2", "Print", "StringFormat"})
SCATTER_OPS = frozenset({"ScatterNd", "TensorScatterUpdate", "TensorScatterAdd", "Where",
                         "Unique", "DynamicPartition", "DynamicStitch", "InTopKV2",
                         "RandomUniform", "RandomStandardNormal", "StatelessRandomUniformV2",
                         "StatelessRandomNormalV2", "StatelessRandomGetKeyCounter"})
READ_OPS = frozenset({"ReadVariableOp"})

LIGHT_OPS = UNARY_OPS | BINARY_OPS | RESHAPE_OPS | SOFTMAX_OPS | frozenset({"IdentityN"})
KNOWN_OPS = (HEAVY_OPS | GATHER_OPS | BATCHNORM_OPS | LIGHT_OPS | REDUCE_OPS | META_OPS
             | SOURCE_OPS | SIDE_EFFECT_OPS | SCATTER_OPS | READ_OPS)
