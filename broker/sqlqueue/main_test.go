package sqlqueue_test

import (
	"io"
	"log"
	"os"
	"testing"

	"github.com/go-sql-driver/mysql"
)

func TestMain(m *testing.M) {
	// The tests cut MariaDB connections on purpose; the driver would print each one.
	_ = mysql.SetLogger(log.New(io.Discard, "", 0))
	os.Exit(m.Run())
}
