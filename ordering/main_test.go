package ordering_test

import (
	"os"
	"testing"
)

// TestMain lets the test binary stand in for a consumer process of the multi-process tests:
// they run os.Args[0] with the consumer's configuration in the environment variable
// consumerEnv.
func TestMain(m *testing.M) {
	if cfg := os.Getenv(consumerEnv); cfg != "" {
		if err := runConsumer(cfg); err != nil {
			os.Stderr.WriteString("order consumer: " + err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}
