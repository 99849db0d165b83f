"""What CuPy offers, as data: the names, array methods, ufunc methods and parameters
the CuPy stand-in (standin_cupy.py) takes from NumPy; anything else it refuses as CuPy
does.

Read from CuPy's sources (cupy/__init__.py, cupy/linalg and cupy/random's __init__.py,
cupy/random/_generator_api.pyx, cupy/_core/core.pyx, cupy/_core/_kernel.pyx) at
v12.0.0 and v14.0.0: the names of CuPy 12 that 13 and 14 kept.  Names that came
later (``cupy.acos``, ``concat``, ``astype``, ``delete``, ``put_along_axis``,
``linalg.eig``, ``ndarray.mT``, ``sort(kind=)``) count as missing: CuPy 12 lacks them.
"""

#: NumPy's ufuncs that are CuPy ufuncs too.
CUPY_UFUNCS = frozenset("""
    abs absolute add arccos arccosh arcsin arcsinh arctan arctan2 arctanh
    bitwise_and bitwise_not bitwise_or bitwise_xor cbrt ceil conj conjugate copysign
    cos cosh deg2rad degrees divide divmod equal exp exp2 expm1 fabs float_power
    floor floor_divide fmax fmin fmod frexp gcd greater greater_equal heaviside
    hypot invert isfinite isinf isnan lcm ldexp left_shift less less_equal log log10
    log1p log2 logaddexp logaddexp2 logical_and logical_not logical_or logical_xor
    maximum minimum mod modf multiply negative nextafter not_equal positive
    power rad2deg radians reciprocal remainder right_shift rint sign signbit sin
    sinh sqrt square subtract tan tanh true_divide trunc
""".split())

#: The rest of the ``cupy`` namespace that NumPy has too (functions, dtypes, constants;
#: ``matmul`` is a generalized ufunc in CuPy, without ufunc methods).  The stand-in
#: takes these from NumPy; ``ndarray``, ``ufunc``, ``linalg``, ``random`` and CuPy's
#: own names (``cuda``, ``asnumpy``...) are its own; everything else raises
#: AttributeError, as CuPy's module does (``fft``, ``polynomial`` and ``testing``
#: are CuPy's too, but not stood in for).
CUPY_NAMES = CUPY_UFUNCS | frozenset("""
    all allclose amax amin angle any append apply_along_axis arange argmax argmin
    argpartition argsort argwhere around array array2string array_equal array_equiv
    array_repr array_split array_str asanyarray asarray asarray_chkfinite
    ascontiguousarray asfortranarray atleast_1d atleast_2d atleast_3d average
    bartlett base_repr binary_repr bincount blackman bool_ broadcast
    broadcast_arrays broadcast_shapes broadcast_to byte c_ can_cast cdouble choose
    clip column_stack common_type complex128 complex64 complexfloating compress
    concatenate convolve copy copyto corrcoef correlate count_nonzero cov cross
    csingle cumprod cumsum diag diag_indices diag_indices_from diagflat diagonal
    diff digitize dot double dsplit dstack dtype e ediff1d einsum empty empty_like
    euler_gamma expand_dims extract eye fill_diagonal finfo fix flatiter flatnonzero
    flip fliplr flipud float16 float32 float64 floating format_float_positional
    format_float_scientific from_dlpack frombuffer fromfile fromfunction fromiter
    fromstring full full_like generic genfromtxt get_printoptions gradient half
    hamming hanning histogram histogram2d histogramdd hsplit hstack i0 identity
    iinfo imag index_exp indices inexact inf inner int16 int32 int64 int8 int_ intc
    integer interp intersect1d intp isclose iscomplex iscomplexobj isfortran isin
    isneginf isposinf isreal isrealobj isscalar issubdtype iterable ix_ kaiser kron
    lexsort linspace load loadtxt logspace longlong mask_indices matmul max
    may_share_memory mean median meshgrid mgrid min min_scalar_type mintypecode
    moveaxis nan nan_to_num nanargmax nanargmin nancumprod nancumsum nanmax nanmean
    nanmedian nanmin nanprod nanstd nansum nanvar ndim ndindex newaxis nonzero
    number ogrid ones ones_like outer packbits pad partition percentile pi piecewise
    place poly poly1d polyadd polyfit polymul polysub polyval printoptions prod
    promote_types ptp put putmask quantile r_ ravel ravel_multi_index real
    real_if_close repeat require reshape resize result_type roll rollaxis roots
    rot90 round row_stack s_ save savetxt savez savez_compressed searchsorted select
    set_printoptions setdiff1d setxor1d shape shares_memory short show_config
    signedinteger sinc single size sort sort_complex split squeeze stack std sum
    swapaxes take take_along_axis tensordot tile trace transpose tri tril
    tril_indices tril_indices_from trim_zeros triu triu_indices triu_indices_from
    typename ubyte uint uint16 uint32 uint64 uint8 uintc uintp ulonglong union1d
    unique unpackbits unravel_index unsignedinteger unwrap ushort vander var vdot
    vectorize vsplit vstack where zeros zeros_like
""".split())

#: ``cupy.linalg``.
CUPY_LINALG = frozenset("""
    LinAlgError cholesky det eigh eigvalsh inv lstsq matrix_power matrix_rank norm
    pinv qr slogdet solve svd tensorinv tensorsolve
""".split())

#: ``cupy.random``'s functions that NumPy has (they are ``RandomState``'s methods too).
CUPY_RANDOM = frozenset("""
    beta binomial bytes chisquare choice dirichlet exponential f gamma geometric
    gumbel hypergeometric laplace logistic lognormal logseries multinomial
    multivariate_normal negative_binomial noncentral_chisquare noncentral_f normal
    pareto permutation poisson power rand randint randn random random_integers
    random_sample ranf rayleigh sample seed shuffle standard_cauchy
    standard_exponential standard_gamma standard_normal standard_t triangular
    uniform vonmises wald weibull zipf
""".split())

#: The methods of ``cupy.random.default_rng()``'s Generator (no ``normal``, no
#: ``choice``: fewer than NumPy's).
CUPY_GENERATOR = frozenset("""
    random uniform integers beta chisquare dirichlet exponential f geometric
    hypergeometric logseries standard_exponential poisson power standard_normal gamma
    standard_gamma binomial
""".split())

#: The keywords a CuPy ufunc call takes (no ``where``, ``order``, ``subok``).
UFUNC_KEYWORDS = frozenset(("out", "dtype", "casting"))

#: The ufuncs each of CuPy's ufunc methods works on (``outer`` works on all); the
#: others raise NotImplementedError.  NumPy's ufunc methods (``np.add.at(device,
#: ...)``) are refused on CuPy 12's arrays, which hand only ``__call__`` to CuPy.
UFUNC_METHODS = {
    "at": frozenset(("add", "subtract", "maximum", "minimum", "bitwise_and",
                     "bitwise_or", "bitwise_xor")),
    "reduce": frozenset(("add", "multiply")),
    "accumulate": frozenset(("add", "multiply")),
    "reduceat": frozenset(("add",)),
}

#: The NumPy array methods (and properties) a CuPy array has, with the parameters
#: CuPy's take; ``*`` marks one that takes any number of positional arguments.
ARRAY_METHODS = {name: tuple(params.split()) for name, params in {
    "all": "axis out keepdims", "any": "axis out keepdims",
    "argmax": "axis out dtype keepdims", "argmin": "axis out dtype keepdims",
    "argpartition": "kth axis", "argsort": "axis", "choose": "choices out mode",
    "clip": "min max out", "compress": "condition axis out", "conj": "",
    "conjugate": "", "copy": "order", "cumprod": "axis dtype out",
    "cumsum": "axis dtype out", "diagonal": "offset axis1 axis2", "dot": "b out",
    "dump": "file", "dumps": "", "fill": "value", "flatten": "order",
    "max": "axis out keepdims", "min": "axis out keepdims",
    "mean": "axis dtype out keepdims", "nonzero": "", "partition": "kth axis",
    "prod": "axis dtype out keepdims", "ptp": "axis out keepdims",
    "put": "indices values mode", "ravel": "order", "repeat": "repeats axis",
    "reshape": "* order", "round": "decimals out", "searchsorted": "v side sorter",
    "sort": "axis", "squeeze": "axis", "std": "axis dtype out ddof keepdims",
    "sum": "axis dtype out keepdims", "swapaxes": "axis1 axis2",
    "take": "indices axis out", "tofile": "fid sep format",
    "trace": "offset axis1 axis2 dtype out", "transpose": "*",
    "var": "axis dtype out ddof keepdims", "view": "dtype",
}.items()}
#: The parameters of CuPy's functions where NumPy's take more (``where=``,
#: ``initial=``, ``like=``, ``device=``, ``mode=``, ``sorted=``...).
FUNCTION_PARAMETERS = {name: tuple(params.split()) for name, params in {
    "empty": "shape dtype order", "zeros": "shape dtype order",
    "ones": "shape dtype order", "full": "shape fill_value dtype order",
    "arange": "start stop step dtype", "take": "a indices axis out",
    "clip": "a a_min a_max out", "searchsorted": "a v side sorter",
    "sort": "a axis kind", "argsort": "a axis kind",
    "unique": "ar return_index return_inverse return_counts axis equal_nan",
    "sum": "a axis dtype out keepdims", "prod": "a axis dtype out keepdims",
    "mean": "a axis dtype out keepdims", "all": "a axis out keepdims",
    "any": "a axis out keepdims", "amax": "a axis out keepdims",
    "amin": "a axis out keepdims", "max": "a axis out keepdims",
    "min": "a axis out keepdims", "argmax": "a axis dtype out keepdims",
    "argmin": "a axis dtype out keepdims",
}.items()}
#: ... and its properties the stand-in takes from NumPy.
ARRAY_PROPERTIES = frozenset(("real", "imag", "flat", "base"))
