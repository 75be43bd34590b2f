// The definitions of the instances test_instances.hpp declares.
#include "test_instances.hpp"

KVDECODE_TEST_INSTANCES()
