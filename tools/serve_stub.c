/* entmaxkv serve in a build without libmicrohttpd (docs/cli.md, "serve"): says how to get it. */
#include "cli.h"

int cmd_serve(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "entmaxkv serve: this entmaxkv was built without libmicrohttpd, the HTTP "
                    "library the server needs. On Debian: apt-get install libmicrohttpd-dev "
                    "(scripts/deps.sh does it), then configure and build again.\n");
    return 1;
}
