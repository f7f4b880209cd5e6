/* shapes.c: the compiled shapes of a context (docs/c_runtime.md, "Bundles of several shapes"): which one a call runs
 * at (the rule of sdk/runtime/runtime.py Runtime.shape_for) and the calls that list them. */
#include <stdio.h>

#include "context.h"

long cb_shape_for(const colibri_ctx *c, size_t batch, size_t tokens) {
    for (size_t k = 0; k < c->n_shapes; k++)
        if (batch <= (size_t)c->shapes[k].batch && tokens <= (size_t)c->shapes[k].tokens) return (long)k;
    return -1;
}

int colibri_shape_count(colibri_ctx *c, uint32_t *count) {
    ENTER(c, "colibri_shape_count");
    int rc = COLIBRI_OK;
    if (!count)
        rc = cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG, "colibri_shape_count: count is NULL");
    else
        *count = (uint32_t)c->n_shapes;
    pthread_mutex_unlock(&c->lock);
    return rc;
}

int colibri_shape_at(colibri_ctx *c, uint32_t index, colibri_shape *shape) {
    ENTER(c, "colibri_shape_at");
    int rc = COLIBRI_OK;
    if (!shape) {
        rc = cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG, "colibri_shape_at: shape is NULL");
    } else if (index >= c->n_shapes) {
        rc = cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG, "colibri_shape_at: index %u; allowed: 0..%zu (the compiled "
                     "shapes, smallest first)", index, c->n_shapes - 1);
    } else {
        const shape_plan *p = &c->shapes[index];
        shape->batch = (uint32_t)p->batch;
        shape->tokens = (uint32_t)p->tokens;
        shape->launches = (uint32_t)p->n_launches;
        shape->input_bytes = p->io_bytes;
        shape->calls = p->calls;
    }
    pthread_mutex_unlock(&c->lock);
    return rc;
}

int colibri_shape_for(colibri_ctx *c, size_t batch, size_t tokens, uint32_t *index) {
    ENTER(c, "colibri_shape_for");
    int rc = COLIBRI_OK;
    const long k = batch && tokens ? cb_shape_for(c, batch, tokens) : -1;
    if (!index)
        rc = cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG, "colibri_shape_for: index is NULL");
    else if (!batch || !tokens)
        rc = cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG, "colibri_shape_for: batch %zu x tokens %zu; allowed: 1 or more "
                     "each", batch, tokens);
    else if (k < 0)
        rc = cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG, "colibri_shape_for: input batch %zu x tokens %zu is larger than "
                     "every compiled shape; the largest is batch %d x tokens %d (build with a larger shape.batch / "
                     "shape.tokens)", batch, tokens, c->batch, c->tokens);
    else
        *index = (uint32_t)k;
    pthread_mutex_unlock(&c->lock);
    return rc;
}

int colibri_last_shape(colibri_ctx *c, uint32_t *index) {
    ENTER(c, "colibri_last_shape");
    int rc = COLIBRI_OK;
    if (!index)
        rc = cb_fail(&c->err, COLIBRI_ERR_INVALID_ARG, "colibri_last_shape: index is NULL");
    else if (!c->has_output)
        rc = cb_fail(&c->err, COLIBRI_ERR_STATE, "colibri_last_shape: no call yet; call colibri_infer first");
    else
        *index = (uint32_t)c->out_shape;
    pthread_mutex_unlock(&c->lock);
    return rc;
}

