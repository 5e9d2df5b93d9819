/*
 * The datadist.engine._native module: the functions of every file here, the key types
 * and the largest summed payload the fast paths take (FAST_SUMMED_MAX).
 */
#include "native.h"

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_native",
    .m_doc = "Executors of datadist copy plans.",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyMethodDef *tables[] = {dd_plan_methods, dd_socket_methods, dd_serve_methods, dd_key_methods, dd_meter_methods};
    for (size_t i = 0; i < sizeof(tables) / sizeof(tables[0]); i++)
        if (PyModule_AddFunctions(m, tables[i]) < 0) goto fail;
    if (dd_add_key_types(m) < 0 || PyModule_AddIntConstant(m, "FAST_SUMMED_MAX", DD_FAST_SUMMED_MAX) < 0) goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
