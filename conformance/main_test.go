package conformance_test

import (
	"flag"
	"io"
	"log"
	"os"
	"strconv"
	"testing"

	"github.com/go-sql-driver/mysql"

	"github.com/onceflow/onceflow/conformance"
)

// matrixParallel is how many tests of the matrix run at once unless -parallel says otherwise.
// The tests spend their time waiting for the brokers and databases, not on the CPU, so the
// default of GOMAXPROCS (2 on the project's machines) would leave the run mostly idle; more
// than this would take more of PostgreSQL's connections than the budget of pgSlots allows,
// beside the other packages' tests that `make test` runs at the same time.
const matrixParallel = 12

func TestMain(m *testing.M) {
	// The Poison scenario runs its consumers as child processes of this binary.
	conformance.ConsumerMain()
	flag.Parse()
	explicit := false
	flag.Visit(func(f *flag.Flag) {
		if f.Name == "test.parallel" {
			explicit = true
		}
	})
	if !explicit {
		_ = flag.Set("test.parallel", strconv.Itoa(matrixParallel))
	}
	// ConnectionCut cuts MySQL queue connections on purpose; the driver would print each one.
	_ = mysql.SetLogger(log.New(io.Discard, "", 0))
	os.Exit(m.Run())
}
