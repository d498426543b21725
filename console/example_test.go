package console_test

import (
	"log"
	"net/http"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/console"
	"github.com/onceflow/onceflow/sqldb"
)

// The console mounted in a service beside its router, under /ops/onceflow/, allowing changes
// to the operators the service's own authentication says are operators.
func Example() {
	var (
		router *onceflow.Router // the service's router, its broker and its database
		queue  *broker.Broker
		db     *sqldb.DB
	)
	c, err := console.New(console.Config{
		Router: router, // the service's *onceflow.Router: handlers' state, rates, outcomes
		Broker: queue,  // the *broker.Broker of the dead-letter topic
		DB:     db,     // the *sqldb.DB of the dedup table and the outbox
		Authorize: func(r *http.Request) error {
			return requireOperator(r) // the service's own check, on every replay or delete
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/ops/onceflow/", http.StripPrefix("/ops/onceflow", c))
	_ = mux // served with the service's other routes
}

func requireOperator(*http.Request) error { return nil }
