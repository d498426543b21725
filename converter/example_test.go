package converter_test

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/converter"
)

// A producer that gives the same order a new message id each time it sends it again still
// carries the order's id in the payload: taken as the message id, it makes the copies one
// message, processed once. A handler takes the converter in Handler.Converter.
func ExampleJSONField() {
	conv := converter.New(converter.Config{ID: converter.JSONField("order.id")})
	for _, uuid := range []string{"", "3f2a", "9c41"} {
		msg := message.NewMessage(uuid, []byte(`{"order": {"id": "o-17", "total": 1250}}`))
		md, err := conv.FromMessage("orders", msg)
		fmt.Println(md.ID, err)
	}
	// Output:
	// o-17 <nil>
	// o-17 <nil>
	// o-17 <nil>
}
