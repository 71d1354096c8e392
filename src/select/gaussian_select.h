/* The gaussian selection policy (gaussian.c), called by ekv_select_pages. */
#ifndef EKV_GAUSSIAN_SELECT_H
#define EKV_GAUSSIAN_SELECT_H
#include "../cpu/attend.h"

/* Arguments already validated (ekv_decode_supported checks the alpha and the selector's
 * parameters; ekv_validate_select the statistics, the list capacity and list->tau). */
ekv_list_policy ekv_select_gaussian;
#endif
