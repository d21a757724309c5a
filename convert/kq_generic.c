/* The K-quant block encoders for any CPU (see kq_common.h). */
#define KQ_NAME(f) f##_generic
#include "kq_blocks.h"
