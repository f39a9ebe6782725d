/* strata-coordinator: the coordinator alone; workers join it from elsewhere (deploy/). */
#include "coordinator/service/serve.h"

int main(int argc, char **argv)
{
    return serve_main(argc, argv, "strata-coordinator", false);
}
